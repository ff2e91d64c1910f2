"""A pre-quantized checkpoint's scheme, read from config.json's `quantization_config` as transformers and vLLM read it.

Formats read (every other method, bit width, strategy or activation scheme is refused naming the field):

- compressed-tensors (llm-compressor): `pack-quantized` int4/int8 weights (per channel or in groups along the input,
  symmetric or with zero points, `actorder` groups), `float-quantized` FP8 weights (per tensor or per channel, FP8
  activations per token or static per tensor), `int-quantized` W8A8 (int8 weights per channel, int8 activations per
  token or static per tensor), `naive-quantized` (int8 weights stored unpacked).
- FP8 (`quant_method: fp8`: DeepSeek-V3, Qwen3-*-FP8): float8_e4m3 weights in blocks of `weight_block_size` with a
  float32 scale each, activations quantized dynamically.
- AWQ (`quant_method: awq`, `version: gemm`): 4-bit weights with zero points in groups along the input.
- GPTQ (`quant_method: gptq`): 4- or 8-bit weights in groups, symmetric or with zero points, `desc_act` (the groups
  given per input row by `g_idx`).

Whatever the format, the weights are described the same way (WeightQuantization): a weight W [in, out] is stored as
integer or FP8 codes q with a scale per block of `block` = (input rows, output columns) and, for asymmetric schemes, a
zero point per block: W = (q - zero) * scale. The readers (jaxpage.models.quantized) turn each format's tensors into
that form, and one layer (jaxpage.models.quantized.dense) multiplies by it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxpage.errors import ModelLoadError
from jaxpage.validation import describe, is_int

WEIGHT_DTYPES = ("int4", "int8", "float8_e4m3fn")
ACTIVATION_DTYPES = ("int8", "float8_e4m3fn")
# The projections a decoder layer multiplies by, by their transformers names, and the LM head.
LAYER_PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
LM_HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    """How a checkpoint stores its projections' weights (hashable: part of ModelConfig, static in the jitted step).

    method:       the checkpoint's quant_method, as config.json names it
    weight_dtype: the codes' type: "int4", "int8" (signed: unsigned codes are shifted as they load) or "float8_e4m3fn"
    block:        (input rows, output columns) sharing one scale; 0 for the whole axis: (0, 1) per output channel,
                  (0, 0) per tensor, (128, 1) groups of 128 inputs, (128, 128) FP8 blocks
    symmetric:    no zero points
    act_order:    the input rows' groups are given per row (GPTQ's desc_act, compressed-tensors' actorder "group"):
                  the rows are permuted as they load so that each group is contiguous, the activations with them
    activations:  None: weight-only (the weights dequantized inside the product); "int8" or "float8_e4m3fn": the
                  activations are quantized too, per token (dynamic) or by the checkpoint's `input_scale`
    static_activations: the activations' scale is the checkpoint's `input_scale` (one per tensor)
    quantized:    the projections stored quantized, of LAYER_PROJECTIONS and LM_HEAD; the others are floats
    stored_zero_offset: what the stored zero points lack (GPTQ's original format stores zero - 1: 1)
    """

    method: str
    weight_dtype: str
    block: tuple[int, int]
    symmetric: bool = True
    act_order: bool = False
    activations: str | None = None
    static_activations: bool = False
    quantized: frozenset[str] = frozenset(LAYER_PROJECTIONS)
    stored_zero_offset: int = 0  # GPTQ's original format stores each zero point less 1: 1 there

    def __post_init__(self):
        assert self.weight_dtype in WEIGHT_DTYPES, self.weight_dtype
        assert self.activations is None or self.activations in ACTIVATION_DTYPES, self.activations
        assert self.quantized <= {*LAYER_PROJECTIONS, LM_HEAD}, self.quantized

    @property
    def bits(self) -> int:
        return 4 if self.weight_dtype == "int4" else 8

    def describe(self) -> str:
        """A line for logs and error messages: "gptq int4, groups of 128 inputs, zero points, act order"."""
        rows, cols = self.block
        if (rows, cols) == (0, 0):
            blocks = "per tensor"
        elif (rows, cols) == (0, 1):
            blocks = "per output channel"
        elif cols == 1:
            blocks = f"groups of {rows} inputs"
        else:
            blocks = f"blocks of {rows} x {cols}"
        parts = [f"{self.method} {self.weight_dtype}", blocks]
        parts += [] if self.symmetric else ["zero points"]
        parts += ["act order"] if self.act_order else []
        if self.activations:
            parts.append(f"{self.activations} activations ({'static' if self.static_activations else 'per token'})")
        return ", ".join(parts)


def weight_quantization_from_hf(hf: dict[str, Any], source: str) -> WeightQuantization | None:
    """The checkpoint's WeightQuantization from its config.json (None for float weights); ModelLoadError naming
    `source` and the field for a method, bit width, strategy or activation scheme jaxpage does not read."""
    key = next((k for k in ("quantization_config", "compression_config") if hf.get(k) is not None), None)
    if key is None:
        return None
    settings = hf[key]
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{source}: {key} must be an object, got {describe(settings)}")
    method = settings.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        what = f"{key} with quant_method {describe(method)}" if method is not None else f"{key} {describe(settings)}"
        raise ModelLoadError(
            f"{source}: {what} is not supported: jaxpage reads {', '.join(readers)} checkpoints, unquantized "
            "safetensors and GGUF files (quantization='int8' quantizes float weights as they load)"
        )
    try:
        return readers[method](settings)
    except _Refused as e:
        raise ModelLoadError(f"{source}: {key}.{e.field} {e.why}") from None


class _Refused(Exception):
    def __init__(self, field: str, why: str):
        super().__init__(field, why)
        self.field, self.why = field, why


def _get(settings: dict, field: str, kinds: tuple[type, ...], default: Any = ..., prefix: str = "") -> Any:
    value = settings.get(field, default)
    if value is ...:
        raise _Refused(prefix + field, "is missing")
    if value is not None and not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise _Refused(prefix + field, f"has the wrong type: {describe(value)}")
    return value


def _choice(settings: dict, field: str, choices: tuple, default: Any = ..., prefix: str = "", why: str = "") -> Any:
    value = settings.get(field, default)
    if value is ...:
        raise _Refused(prefix + field, "is missing")
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise _Refused(prefix + field, f"{describe(value)} is not supported{why} (jaxpage reads {listed})")
    return value


def _size(settings: dict, field: str, prefix: str = "") -> int:
    value = settings.get(field)
    if not is_int(value) or value <= 0:
        raise _Refused(prefix + field, f"must be a positive integer, got {describe(value)}")
    return int(value)


def _covered(targets: list, ignore: list, modules: tuple[str, ...]) -> frozenset[str]:
    """Of `modules` (LAYER_PROJECTIONS and LM_HEAD), those `targets` name and `ignore` does not, by compressed-tensors'
    matching: a class name ("Linear": every projection), "re:" and a regular expression over the module's full name
    (model.layers.0.self_attn.q_proj), or a name the full name ends with. A layer projection must be covered in every
    layer or in none (the layers are one stacked array)."""

    def full_names(module: str) -> list[str]:
        return [LM_HEAD] if module == LM_HEAD else [f"model.layers.{i}.{module}" for i in range(3)]

    def matches(pattern: str, name: str) -> bool:
        if pattern == "Linear":
            return True
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None
        return name == pattern or name.endswith("." + pattern)

    covered = set()
    for module in modules:
        hits = {
            any(matches(t, n) for t in targets) and not any(matches(i, n) for i in ignore) for n in full_names(module)
        }
        if len(hits) > 1:
            raise _Refused("ignore", f"leaves {module} in floats in some layers only; jaxpage quantizes a projection "
                           "in every layer or in none")  # fmt: skip
        if hits == {True}:
            covered.add(module)
    return frozenset(covered)


def _strings(settings: dict, field: str) -> list[str]:
    value = settings.get(field) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Refused(field, f"must be a list of module names, got {describe(value)}")
    return value


def _per_layer_ignore(ignore: list[str]) -> None:
    """Refuse ignored modules jaxpage cannot leave in floats alone: one layer's projection, a whole layer."""
    for name in ignore:
        if re.fullmatch(r"(model\.)?layers\.\d+\..*", name):
            raise _Refused("ignore", f"leaves {name} in floats in one layer only; jaxpage quantizes a projection in "
                           "every layer or in none")  # fmt: skip


def _compressed_tensors(settings: dict) -> WeightQuantization:
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if settings.get(field):
            raise _Refused(field, "is not supported (jaxpage reads dense quantized weights, no KV cache scheme)")
    _choice(settings, "quantization_status", ("compressed",), "compressed", why=" (the weights must be stored packed)")
    groups = _get(settings, "config_groups", (dict,))
    if not groups:
        raise _Refused("config_groups", "is empty")
    ignore = _strings(settings, "ignore")
    _per_layer_ignore(ignore)
    global_format = settings.get("format")
    schemes, covered = set(), set()
    for name, group in groups.items():
        prefix = f"config_groups.{name}."
        if not isinstance(group, dict):
            raise _Refused(prefix[:-1], f"must be an object, got {describe(group)}")
        targets = _get(group, "targets", (list,), prefix=prefix)
        if group.get("output_activations") is not None:
            raise _Refused(prefix + "output_activations", "is not supported (only weights and inputs are quantized)")
        fmt = group.get("format") or global_format
        schemes.add(_compressed_tensors_group(group, fmt, prefix))
        mine = _covered(targets, ignore, (*LAYER_PROJECTIONS, LM_HEAD))
        if mine & covered:
            raise _Refused(prefix + "targets", f"overlap another group's ({', '.join(sorted(mine & covered))})")
        covered |= mine
    if len(schemes) > 1:
        raise _Refused("config_groups", "quantize projections in different schemes; jaxpage reads one scheme a model")
    if not covered & set(LAYER_PROJECTIONS):
        raise _Refused("config_groups", "quantize none of the layers' projections")
    return dataclasses.replace(schemes.pop(), quantized=frozenset(covered))


def _compressed_tensors_group(group: dict, fmt, prefix: str) -> WeightQuantization:
    formats = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")
    fmt = _choice({"format": fmt}, "format", formats, prefix=prefix)
    weights = _get(group, "weights", (dict,), prefix=prefix)
    w = prefix + "weights."
    kind = _choice(weights, "type", ("int", "float"), prefix=w)
    bits = _choice(weights, "num_bits", (4, 8) if kind == "int" else (8,), prefix=w)
    if kind == "float" and fmt != "float-quantized" or kind == "int" and fmt == "float-quantized":
        raise _Refused(prefix + "format", f"{fmt!r} does not hold {kind} weights")
    if fmt in ("int-quantized", "naive-quantized") and bits != 8:
        raise _Refused(prefix + "format", f"{fmt!r} holds 8-bit weights, not {bits}-bit")
    if weights.get("dynamic"):
        raise _Refused(w + "dynamic", "is not supported (weights are quantized when written)")
    symmetric = _get(weights, "symmetric", (bool,), True, prefix=w)
    if kind == "float" and not symmetric:
        raise _Refused(w + "symmetric", "false is not supported for float weights")
    strategy = _choice(weights, "strategy", ("tensor", "channel", "group", "block"), prefix=w)
    if strategy == "group":
        block = (_size(weights, "group_size", prefix=w), 1)
    elif strategy == "block":
        structure = weights.get("block_structure")
        if not (isinstance(structure, list) and len(structure) == 2 and all(is_int(v) and v > 0 for v in structure)):
            raise _Refused(w + "block_structure", f"must be two positive integers, got {describe(structure)}")
        block = (int(structure[1]), int(structure[0]))  # [output rows, input columns] of the torch weight
    else:
        block = (0, 0) if strategy == "tensor" else (0, 1)
    actorder = _choice(weights, "actorder", (None, "group", "weight", "static"), None, prefix=w)
    if strategy != "group" and actorder == "group":
        raise _Refused(w + "actorder", "'group' needs the group strategy")
    activations, static = _compressed_tensors_activations(group.get("input_activations"), prefix, kind)
    if activations and strategy == "group":
        raise _Refused(prefix + "input_activations", "with grouped weights are not supported (weight-only groups)")
    dtype = "float8_e4m3fn" if kind == "float" else f"int{bits}"
    if fmt != "pack-quantized" and dtype == "int8" and not symmetric:
        raise _Refused(w + "symmetric", f"false is not supported in {fmt!r}")
    return WeightQuantization("compressed-tensors", dtype, block, symmetric, actorder == "group", activations, static)


def _compressed_tensors_activations(args, prefix: str, weight_kind: str) -> tuple[str | None, bool]:
    if args is None:
        return None, False
    a = prefix + "input_activations."
    if not isinstance(args, dict):
        raise _Refused(a[:-1], f"must be an object, got {describe(args)}")
    kind = _choice(args, "type", (weight_kind,), prefix=a, why=f" with {weight_kind} weights")
    _choice(args, "num_bits", (8,), prefix=a)
    if not _get(args, "symmetric", (bool,), True, prefix=a):
        raise _Refused(a + "symmetric", "false is not supported (asymmetric activations)")
    dynamic = _get(args, "dynamic", (bool, str), False, prefix=a)
    strategy = _choice(args, "strategy", ("token", "tensor"), prefix=a)
    if (strategy, dynamic) not in (("token", True), ("tensor", False)):
        raise _Refused(a + "strategy", f"{strategy!r} with dynamic {dynamic!r} is not supported (jaxpage reads "
                       "dynamic per-token and static per-tensor activations)")  # fmt: skip
    return ("float8_e4m3fn" if kind == "float" else "int8"), not dynamic


def _fp8(settings: dict) -> WeightQuantization:
    _choice(settings, "fmt", ("e4m3",), "e4m3")
    _choice(settings, "activation_scheme", ("dynamic",), "dynamic")
    block = settings.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(is_int(v) and v > 0 for v in block)):
        raise _Refused("weight_block_size", f"must be two positive integers, got {describe(block)}")
    ignore = _strings(settings, "modules_to_not_convert") + _strings(settings, "ignored_layers")
    _per_layer_ignore(ignore)
    covered = _covered(["Linear"], ignore, LAYER_PROJECTIONS)  # transformers and vLLM leave the LM head in floats
    # [output rows, input columns] of the torch weight; the activations are quantized per token and block of inputs
    # on chips with FP8 products, and left in the model's dtype elsewhere (see jaxpage.models.quantized.dense)
    return WeightQuantization("fp8", "float8_e4m3fn", (int(block[1]), int(block[0])), quantized=covered)


def _awq(settings: dict) -> WeightQuantization:
    _choice(settings, "version", ("gemm",), "gemm", why=" (jaxpage reads AWQ's GEMM packing)")
    _choice(settings, "bits", (4,), why=" (AWQ's GEMM packing is 4-bit)")
    if not _get(settings, "zero_point", (bool,), True):
        raise _Refused("zero_point", "false is not supported (AWQ's GEMM packing has zero points)")
    group = _awq_gptq_group(settings)
    ignore = _strings(settings, "modules_to_not_convert")
    _per_layer_ignore(ignore)
    covered = _covered(list(LAYER_PROJECTIONS), ignore, (*LAYER_PROJECTIONS, LM_HEAD))
    return WeightQuantization("awq", "int4", (group, 1), symmetric=False, quantized=covered)


def _gptq(settings: dict) -> WeightQuantization:
    bits = _choice(settings, "bits", (4, 8))
    checkpoint_format = _choice(settings, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
    symmetric = _get(settings, "sym", (bool,), True)
    desc_act = _get(settings, "desc_act", (bool,), False)
    group = _awq_gptq_group(settings)
    if settings.get("dynamic"):
        raise _Refused("dynamic", "is not supported (per-module bit widths)")
    ignore = _strings(settings, "modules_to_not_convert")
    _per_layer_ignore(ignore)
    covered = _covered(list(LAYER_PROJECTIONS), ignore, (*LAYER_PROJECTIONS, LM_HEAD))
    return WeightQuantization(
        "gptq",
        f"int{bits}",
        (group, 1),
        symmetric=symmetric,
        act_order=desc_act and group > 0,
        quantized=covered,
        stored_zero_offset=1 if checkpoint_format == "gptq" else 0,
    )


def _awq_gptq_group(settings: dict) -> int:
    """group_size: a positive number of input rows per scale, or -1 (one group: per output channel) -> 0."""
    group = settings.get("group_size", 128)
    if group == -1:
        return 0
    if not is_int(group) or group <= 0:
        raise _Refused("group_size", f"must be a positive integer or -1, got {describe(group)}")
    return int(group)
