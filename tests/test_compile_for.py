"""The engine's programs built for chips this host lacks (jaxpage.targets, jaxpage.aot, scripts/compile_for.py).

The tests that compile need the chips' compilers: libtpu (`pip install 'jaxpage[tpu]'`) and jax's CUDA plugin
(`pip install 'jaxpage[cuda]'`), and those of the GPU kernel report CUDA's ptxas and cuobjdump too (all of them:
`pip install 'jaxpage[compile]'`, which .ci/run installs); where they are missing those tests are skipped with that
reason. The others (targets, the pool arithmetic for a chip's memory, finding copies in HLO) always run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import types
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P
from tiny_models import TINY_FAMILIES

from jaxpage import aot
from jaxpage.attention import resolve_backend
from jaxpage.benchmarks import gpu_kernels
from jaxpage.benchmarks.hlo_collectives import executed
from jaxpage.benchmarks.hlo_copies import array_bytes, large_copies, sliced_copies
from jaxpage.config import CacheConfig, EngineConfig
from jaxpage.kv_cache import HybridKVCache
from jaxpage.models.batch_invariant import KEEP_ONE_TRIP_LOOP
from jaxpage.targets import TARGETS, available, get_target
from jaxpage.worker.host_kv_pool import TRANSFER_CHUNK
from jaxpage.worker.pool_sizing import addressable_pages, kv_pool_pages

TPU, GPU = TARGETS["tpu-v5e"], TARGETS["gpu-h200"]
needs_tpu = pytest.mark.skipif(not available(TPU), reason="libtpu is not installed (pip install 'jaxpage[compile]')")
needs_gpu = pytest.mark.skipif(not available(GPU), reason="jax's CUDA plugin is not installed ('jaxpage[compile]')")


def _missing_kernel_tool() -> str | None:
    try:
        gpu_kernels.find_tools()
    except gpu_kernels.MissingToolError as e:
        return str(e)
    return None


needs_kernel_tools = pytest.mark.skipif(_missing_kernel_tool() is not None, reason=str(_missing_kernel_tool()))
TINY_GQA = next(f for f in TINY_FAMILIES if f.name == "llama3-gqa-rope-scaling")  # 4 heads, 2 KV heads
# A small engine: programs pool, forward decode(T=1, 4), sample rows=1, 4, forward mixed(T=16, 64, 128), copy. A pool
# of 16384 pages (hundreds of MiB: nothing is allocated): larger than a TPU's VMEM, which XLA may otherwise prefetch a
# small array into (a copy that is not a relayout), and than any step's temporaries.
NUM_PAGES = 16384
TINY_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, num_pages=NUM_PAGES, compilation_cache_dir=None)
# LoRA adapters (jaxpage.worker.lora_weights: their slots among the parameters, each token's slot in the steps) on the
# fewest step shapes: a decode step and one mixed step of 16 tokens, with the slot fill program.
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
LORA_ENGINE = TINY_ENGINE | dict(max_num_seqs=1, max_num_batched_tokens=16) | LORA
# The batch-invariant mode (engine argument batch_invariant) on the same fewest step shapes.
BATCH_INVARIANT_ENGINE = TINY_ENGINE | dict(max_num_seqs=1, max_num_batched_tokens=16, batch_invariant=True)


def test_targets_name_their_topologies_and_refuse_what_they_cannot_hold():
    assert TARGETS["tpu-v5e"].topology_name(1) == "v5e:2x2"
    assert TARGETS["tpu-v6e"].topology_name(8) == "v6e:2x4"
    assert TARGETS["tpu-v5p"].topology_name(8) == "v5p:2x2x2"
    assert TARGETS["gpu-h100"].topology_name(8) == "1x1x8"
    with pytest.raises(ValueError, match="at most 8 devices, not 16"):
        TARGETS["tpu-v5e"].topology_name(16)
    with pytest.raises(ValueError, match="unknown target 'tpu-v4'.*tpu-v5e, tpu-v6e, tpu-v5p, gpu-h100, gpu-h200"):
        get_target("tpu-v4")


@pytest.mark.parametrize("name", ["gpu-h100", "gpu-h200"])
def test_gpu_target_configs_agree_with_the_figures_the_budget_uses(name):
    target = TARGETS[name]
    config = target.gpu_target_config()
    fields = dict(re.findall(r"^\s*(\w+): (\S+)$", config, re.MULTILINE))
    assert int(fields["device_memory_size"]) == target.hbm_bytes
    assert float(fields["memory_bandwidth"]) == target.hbm_bandwidth
    assert int(fields["shared_memory_per_block_optin"]) == 232448  # compute capability 9.0
    assert "cuda_compute_capability { major: 9 minor: 0 }" in config


def test_the_pool_is_sized_from_a_chips_memory_less_its_weights():
    cache = EngineConfig(gpu_memory_utilization=0.9, compilation_cache_dir=None).part(CacheConfig)
    token_bytes, page_bytes = 1000, 16 * 1000
    limit, weights = 16 << 30, 3 << 30
    # (limit * utilization - weights) / page bytes, as LLMEngine sizes a GPU's or TPU's pool
    assert kv_pool_pages(cache, 64, token_bytes, 1_000_000, device_memory=(limit, weights)) == int(
        (int(limit * 0.9) - weights) // page_bytes
    )
    # no more pages than max_num_seqs sequences of max_model_len can use
    assert kv_pool_pages(cache, 64, token_bytes, 1024, device_memory=(limit, weights)) == 64 * 1024 // 16 + 1
    with pytest.raises(ValueError, match=r"holds no page .* less 16106127360 in use \(the weights\); .* more devices"):
        kv_pool_pages(cache, 64, token_bytes, 1024, device_memory=(limit, 15 << 30))  # an 8B model on a 16 GiB chip
    too_many = EngineConfig(num_pages=(limit - weights) // page_bytes + 1, compilation_cache_dir=None)
    with pytest.raises(ValueError, match="does not fit in the .* bytes of memory available"):
        kv_pool_pages(too_many.part(CacheConfig), 64, token_bytes, 1024, device_memory=(limit, weights))


def test_large_copies_finds_copies_of_pool_sized_arrays_in_hlo():
    hlo = """
HloModule m
ENTRY %main (k: bf16[4,2048,16,3,128]) -> bf16[4,2048,16,3,128] {
  %k = bf16[4,2048,16,3,128]{4,3,2,1,0} parameter(0)
  %copy.5 = bf16[4,2048,16,3,128]{4,3,2,1,0:T(4,128)(2,1)} copy(%k), metadata={op_name="k"}
  %copy-start = (bf16[4,2048,16,3,128]{4,3,2,1,0:S(1)}, bf16[4,2048,16,3,128]{4,3,2,1,0}, u32[]) copy-start(%k)
  %small = f32[8,64]{1,0} copy(%x)
  %t = s8[2048,16,384]{0,1,2} transpose(%y), dimensions={2,1,0}
  ROOT %custom-call = bf16[4,2048,16,3,128]{4,3,2,1,0} custom-call(%copy.5), custom_call_target="tpu_custom_call"
}"""
    pool_bytes = 4 * 2048 * 16 * 3 * 128 * 2
    assert array_bytes("(bf16[2,3]{1,0}, f8e4m3fn[10], u32[])") == 12
    # %copy-start moves the pool into on-chip memory (S(1)): a prefetch, not a relayout
    assert [line.split(" = ")[0] for line in large_copies(hlo, pool_bytes)] == ["%copy.5"]
    assert [line.split(" = ")[0] for line in large_copies(hlo, 2048 * 16 * 384)] == ["%copy.5", "%t"]


def test_large_copies_counts_fusions_by_what_they_materialize():
    # The TPU compiler's int8 weights, retiled as one layer is sliced out in a loop (what it does with a
    # Llama-3-8B's s8 kernels): the whole-array copy is fused into the slice's fusion, which writes one layer.
    # A top-level fusion whose fused computation is a copy writes the whole array.
    hlo = """
HloModule m

%copy_fusion (input: s8[32,4096,14336]) -> s8[32,4096,14336] {
  %input = s8[32,4096,14336]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy.77 = s8[32,4096,14336]{2,1,0:T(8,128)(4,1)} copy(%input)
}

%sliced (p: s8[32,4096,14336], i: s32[]) -> s8[1,4096,14336] {
  %p = s8[32,4096,14336]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[]{:T(128)} parameter(1)
  %fusion.1 = s8[32,4096,14336]{2,1,0:T(8,128)(4,1)} fusion(%p), kind=kLoop, calls=%copy_fusion
  ROOT %ds = s8[1,4096,14336]{2,1,0:T(8,128)(4,1)} dynamic-slice(%fusion.1, %i, %i, %i)
}

%copy_fusion.2 (input.2: s8[32,4096,14336]) -> s8[32,4096,14336] {
  %input.2 = s8[32,4096,14336]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy.78 = s8[32,4096,14336]{2,1,0:T(8,128)(4,1)} copy(%input.2)
}

ENTRY %main (w: s8[32,4096,14336], i: s32[]) -> (s8[1,4096,14336], s8[32,4096,14336]) {
  %w = s8[32,4096,14336]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[]{:T(128)} parameter(1)
  %layer = s8[1,4096,14336]{2,1,0:T(8,128)(4,1)} fusion(%w, %i), kind=kLoop, calls=%sliced
  %whole = s8[32,4096,14336]{2,1,0:T(8,128)(4,1)} fusion(%w), kind=kLoop, calls=%copy_fusion.2
  ROOT %t = (s8[1,4096,14336], s8[32,4096,14336]) tuple(%layer, %whole)
}"""
    assert [line.split(" = ")[0] for line in large_copies(hlo, 4096 * 14336)] == ["%whole"]


def test_sliced_copies_are_copies_of_a_dynamic_slice():
    # XLA's GPU compiler in a scan over stacked layers: one layer's weight sliced out and copied (a fusion whose
    # computation slices and copies), beside a gather of token rows copied as large: only the first is a sliced copy.
    hlo = """
HloModule m

%fused_dynamic_slice (p: bf16[32,4096,14336], i: s32[]) -> bf16[1,4096,14336] {
  %p = bf16[32,4096,14336]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic_slice.1 = bf16[1,4096,14336]{2,1,0} dynamic-slice(%p, %i, %c, %c), dynamic_slice_sizes={1,4096,14336}
  ROOT %copy.1 = bf16[1,4096,14336]{2,1,0} copy(%dynamic_slice.1)
}

ENTRY %main (w: bf16[32,4096,14336], i: s32[], rows: bf16[4096,14336]) -> (bf16[1,4096,14336], bf16[4096,14336]) {
  %w = bf16[32,4096,14336]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %rows = bf16[4096,14336]{2,1,0} parameter(2)
  %layer = bf16[1,4096,14336]{2,1,0} fusion(%w, %i), kind=kCustom, calls=%fused_dynamic_slice
  %gathered = bf16[4096,14336]{1,0} copy(%rows)
  ROOT %t = (bf16[1,4096,14336], bf16[4096,14336]) tuple(%layer, %gathered)
}"""
    assert [line.split(" = ")[0] for line in large_copies(hlo, 4096 * 14336)] == ["%layer", "%gathered"]
    assert [line.split(" = ")[0] for line in sliced_copies(hlo, 4096 * 14336)] == ["%layer"]


@needs_gpu
def test_a_gpus_programs_read_each_layers_weights_in_place(monkeypatch):
    # A scan over stacked layers makes XLA's GPU compiler copy each layer's weights out before its products; the
    # model unrolls its layers on a GPU (llama.layer_unroll), and compile_for's check finds the copies when it does not.
    model = dataclasses.replace(
        aot.model_shape("llama3-8b"), num_layers=2, hidden_size=512, intermediate_size=2048, vocab_size=2048
    )
    # XLA's attention: the copies are the scan's whatever the attention, and the Triton kernels' compiles take seconds.
    engine = EngineConfig(**TINY_ENGINE | dict(max_num_seqs=1, max_num_batched_tokens=32, attention_impl="xla"))
    for scanned in (False, True):
        if scanned:
            monkeypatch.setattr("jaxpage.models.llama.layer_unroll", lambda config, platform=None: 1)
        build = aot.build(GPU, engine, model)
        aot.compile_all(build, kinds={"forward"}, kernels=False)
        assert any(p.weight_copies for p in build.programs) == scanned, [p.weight_copies for p in build.programs]


def _checked(build: aot.TargetBuild) -> None:
    """Every program compiled, none copies the pool or a layer's weights or holds a temporary as large as the pool,
    and the pool's compiled bytes are within 2% of the budget arithmetic."""
    failed = {p.program: p.error for p in build.programs if not p.compiled}
    assert not failed, failed
    assert not [p.pool_copies for p in build.programs if p.pool_copies]
    assert not [p.weight_copies for p in build.programs if p.weight_copies]
    assert not {p.program: p.row_tile_fusions for p in build.programs if p.row_tile_fusions}
    assert max(p.temp_bytes for p in build.programs) < build.pool_array_bytes
    assert abs(build.compiled_pool_bytes / build.pool_bytes - 1) <= 0.02, (build.compiled_pool_bytes, build.pool_bytes)


@needs_tpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_tiny_models_programs_compile_for_a_tpu(tiny_model_path, kv_cache_dtype):
    engine = EngineConfig(kv_cache_dtype=kv_cache_dtype, **TINY_ENGINE | dict(max_num_seqs=1))  # each kind once
    build = aot.build(TPU, engine, aot.model_shape(str(tiny_model_path(TINY_GQA))), num_speculative_tokens=2)
    # With an 8-bit pool, only the programs that touch the pool differ: the samplers are the ones "auto" compiles.
    aot.compile_all(build, kinds=None if kv_cache_dtype == "auto" else {"pool", "forward", "copy"})
    assert build.backend.name == "pallas_tpu" and build.dtype.name == "bfloat16"
    kinds = [p.kind for p in build.programs]
    samplers = ["sample", "sample+masks", "sample+penalties"]  # plain, with logits processors, with penalties too
    verifiers = ["verify", "verify+masks", "verify+penalties"]
    if kv_cache_dtype != "auto":
        samplers = verifiers = []
    mixed = ["forward"] * 3  # T = 16, 64 (small prompts) and 128
    assert kinds == ["pool", "forward", *samplers, *mixed, "forward", *verifiers,
                     *(["prompt_logprobs"] if samplers else []), "copy"]  # fmt: skip
    _checked(build)


@needs_tpu
def test_tensor_parallel_programs_compile_for_a_tpu_slice_with_megatrons_collectives(tiny_model_path):
    engine = EngineConfig(tensor_parallel_size=2, **TINY_ENGINE)
    build = aot.build(TPU, engine, aot.model_shape(str(tiny_model_path(TINY_GQA))))
    aot.compile_all(build)
    _checked(build)
    layers = build.model.num_layers
    for p in build.programs:
        if p.kind == "forward":  # 2 per layer (after the o and down projections) + 1 for the embedding
            assert p.collectives == {"all-reduce": 2 * layers + 1}, (p.program, p.collectives)
        if p.kind == "sample":  # the logits gathered whole (one row's: XLA makes the gather an all-reduce)
            gather = "all-reduce" if p.program.endswith("rows=1") else "all-gather"
            assert p.collectives == {gather: 1}, (p.program, p.collectives)
    whole = aot._placed_params(build.model, build.dtype, None, TPU.devices()[0], TPU.platform)
    assert build.weight_bytes < aot.placed_bytes(whole)


# The families whose forward pass differs from Llama's on the chips: Gemma 2 (soft-capped attention logits, a window
# picked per layer by lax.cond between two kernels) and a mixture of experts (jax.lax.ragged_dot).
FAMILIES_TO_COMPILE = [f for f in TINY_FAMILIES if f.name in ("gemma2-softcap-hybrid", "qwen3-moe-norm-topk")]


@pytest.mark.parametrize(
    "target",
    [pytest.param(TPU, marks=needs_tpu, id="tpu-v5e"), pytest.param(GPU, marks=needs_gpu, id="gpu-h200")],
)
@pytest.mark.parametrize("family", FAMILIES_TO_COMPILE, ids=lambda f: f.name)
def test_model_families_forward_passes_compile_for_the_chips(tiny_model_path, target, family):
    engine = EngineConfig(**TINY_ENGINE | dict(max_num_seqs=1))
    build = aot.build(target, engine, aot.model_shape(str(tiny_model_path(family))))
    aot.compile_all(build, kinds={"pool", "forward"}, kernels=False)  # the kernels' figures: test_the_gpu_kernels_...
    assert build.backend.name == ("pallas_tpu" if target is TPU else "pallas_gpu")
    assert [p.kind for p in build.programs] == ["pool", *["forward"] * 4]  # decode, mixed T = 16, 64, 128
    _checked(build)
    hybrid = family.name.startswith("gemma")  # its sliding layers' pages in a group of their own
    assert isinstance(build.runners[0].kv_cache, HybridKVCache) == hybrid


@needs_tpu
def test_expert_parallel_programs_compile_for_a_tpu_slice_with_no_new_collective(tiny_model_path):
    moe = next(f for f in FAMILIES_TO_COMPILE if f.name == "qwen3-moe-norm-topk")  # 8 experts
    engine = EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True, **TINY_ENGINE | dict(max_num_seqs=2))
    build = aot.build(TPU, engine, aot.model_shape(str(tiny_model_path(moe))))
    aot.compile_all(build, kinds={"pool", "forward"})
    _checked(build)
    assert build.model.expert_parallel_size == 2
    for p in build.programs:
        if p.kind == "forward":  # as tensor parallelism: 2 per layer (o projection, experts) + 1 for the embedding
            assert p.collectives == {"all-reduce": 2 * build.model.num_layers + 1}, (p.program, p.collectives)


@needs_tpu
def test_tensor_parallel_lora_compiles_for_a_tpu_slice_with_no_new_collective(tiny_model_path):
    # The adapters' slots split as their projections (jaxpage.worker.parallel.lora_shardings): a row-parallel
    # projection's (o, down) partial LoRA products are summed by its all-reduce with the base projection's, the
    # column-parallel ones' need none: Megatron's collectives, as without LoRA.
    model = aot.model_shape(str(tiny_model_path(TINY_GQA)))
    build = aot.build(TPU, EngineConfig(**LORA_ENGINE | dict(tensor_parallel_size=2)), model)
    aot.compile_all(build, kinds={"pool", "forward", "lora"})
    _checked(build)
    assert [p.kind for p in build.programs] == ["pool", "forward", "forward", "lora"]
    for p in build.programs:
        if p.kind == "forward":  # 2 per layer (after the o and down projections) + 1 for the embedding
            assert p.collectives == {"all-reduce": 2 * build.model.num_layers + 1}, (p.program, p.collectives)
        if p.kind == "lora":  # each device writes its own shard of the slot
            assert not p.collectives and p.alias_bytes >= build.lora_bytes, (p.collectives, p.alias_bytes)
    slots = build.runners[0].params["lora"]
    assert slots["o_proj"]["a"].sharding.spec == slots["down_proj"]["a"].sharding.spec == P(None, None, "model", None)
    assert slots["q_proj"]["b"].sharding.spec == P(None, None, None, "model")
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(slots))
    assert build.lora_bytes == aot.placed_bytes(slots) < whole


@needs_gpu
def test_the_lora_slots_come_out_of_the_devices_budget_as_the_engine_pays_for_them():
    # An 8B model's pool on an H200, sized from its memory (nothing compiles): the slots of 4 adapters of rank 16 come
    # off the gpu_memory_utilization budget beside the weights (kv_pool_pages' unpooled_bytes, as LLMEngine sizes it):
    # 32 layers x 4 slots x rank 16 x 2 bytes x (the projections' input features, 38912, and output features, 43008)
    # = 320 MiB, 160 pages of 2 MiB fewer.
    engine = dict(max_num_seqs=256, compilation_cache_dir=None)  # 256 sequences of 8192 tokens: more than fits
    plain = aot.build(GPU, EngineConfig(**engine), aot.LLAMA3_8B)
    build = aot.build(GPU, EngineConfig(**engine, enable_lora=True, max_loras=4, max_lora_rank=16), aot.LLAMA3_8B)
    assert build.lora_bytes == aot.placed_bytes(build.runners[0].params["lora"]) == 320 << 20
    assert (plain.lora_bytes, build.weight_bytes) == (0, plain.weight_bytes)
    page_bytes = build.engine.page_size * build.kv_token_bytes
    budget = int(GPU.hbm_bytes * build.engine.gpu_memory_utilization) - build.weight_bytes
    assert [plain.num_pages, build.num_pages] == [budget // page_bytes, (budget - build.lora_bytes) // page_bytes]
    assert plain.num_pages - build.num_pages == 160


def _compile_for_script():
    path = Path(__file__).parents[1] / "scripts" / "compile_for.py"
    spec = importlib.util.spec_from_file_location("compile_for", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_gpu
@needs_kernel_tools
def test_compile_for_reports_every_program_for_a_gpu(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["--target", "gpu-h200", "--model", str(tiny_model_path(TINY_GQA)), "--kv-cache-dtype", "int8"]
    argv += [
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "128",
        "--num-pages",
        str(NUM_PAGES),
        "--json",
        str(out),
    ]
    status = _compile_for_script().main(argv)
    printed = capsys.readouterr().out
    assert "pallas_gpu attention" in printed and "10/10 programs compiled" in printed
    assert "decode step ESTIMATE (roofline, not measured), batch 1" in printed
    report = json.loads(out.read_text())
    samplers = ["sample", "sample+masks", "sample+penalties"]
    assert [p["kind"] for p in report["programs"]] == [
        "pool",
        "forward",
        *samplers,
        *["forward"] * 3,  # mixed steps of 16, 64 and 128 tokens
        "prompt_logprobs",
        "copy",
    ]
    # The kernels' own checks are test_the_gpu_kernels_spill_nothing_and_multiply_on_the_tensor_cores's to pass: here
    # they are made, and decide the exit status with the others.
    checks = {c["check"]: c["passed"] for c in report["checks"]}
    kernel_checks = ["GPU kernels: no stack frame (spills)", "GPU kernels: products on the tensor cores"]
    assert all(passed for check, passed in checks.items() if check not in kernel_checks), report["checks"]
    assert status == (0 if all(checks[check] for check in kernel_checks) else 1)
    layers = report["model"]["num_layers"]
    forward = [p for p in report["programs"] if p["kind"] == "forward"]
    assert [[(k["name"], k["count"]) for k in p["kernels"]] for p in forward] == [
        [("jaxpage_gpu_decode_attention", layers)],
        *[[("jaxpage_gpu_ragged_attention", layers)]] * 3,  # mixed steps of 16, 64 and 128 tokens
    ]
    assert all(p["kernels"] is None for p in report["programs"] if p["kind"] != "forward")
    assert f"{layers} x jaxpage_gpu_ragged_attention" in printed
    assert set(report["kernel_tools"]) == {"ptxas", "cuobjdump"}
    assert report["pool_bytes_compiled"] == pytest.approx(report["pool_bytes_arithmetic"], rel=0.02)
    roofline = report["decode_roofline_estimates"][0]
    assert roofline["seconds"] == pytest.approx(roofline["bytes"] / GPU.hbm_bandwidth)  # batch 1: bandwidth-bound


# conftest.py turns XLA's LLVM optimizations off for the suite (FAST_COMPILE, in XLA_FLAGS), and they shape the Triton
# kernels' PTX (the decode kernel's registers and stack frame differ): the kernels' compiles get XLA's defaults back.
XLA_OPTIMIZATION = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}


@needs_gpu
@needs_kernel_tools
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("shape", ["default", "llama3-8b"])
def test_the_gpu_kernels_spill_nothing_and_multiply_on_the_tensor_cores(shape, kv_cache_dtype):
    # Every Pallas GPU kernel of the forward passes as ptxas assembles it for an H200 (jaxpage.benchmarks.gpu_kernels):
    # no stack frame (spills, or arrays the registers cannot hold: local memory, in HBM behind the caches), and its
    # products on the tensor cores with bfloat16 weights and either pool. The kernels are alike in every layer: 2 layers
    # build the same kernels in a fraction of the time (and a pool of NUM_PAGES: the 8-bit pool of a full model on an
    # H200 is over 4 GiB, which takes 64-bit offsets: jaxpage.attention's addressable_pages). One sequence: a decode
    # step and the mixed steps of 16, 64 and 128 tokens (other step shapes change the kernels' grids and constants, not
    # their code's shape). About 70 s in all on 2 CPU cores with the kernels of this commit, most of it the 8B
    # shape's ragged kernel's spills, in
    # XLA's ptxas and in ours.
    model = dataclasses.replace(aot.model_shape(shape), num_layers=2)
    engine = EngineConfig(kv_cache_dtype=kv_cache_dtype, **TINY_ENGINE | dict(max_num_seqs=1))
    build = aot.build(GPU, engine, model)
    build.runners[0].compiler_options = XLA_OPTIMIZATION  # aot adds its dump directory to them
    aot.compile_all(build, kinds={"forward"})
    assert build.backend.name == "pallas_gpu" and build.dtype.name == "bfloat16"
    failed = {p.program: p.error for p in build.programs if not p.compiled}
    assert not failed, failed
    assert len(build.programs) == 4 and all(p.kernels for p in build.programs), [p.kernels for p in build.programs]
    kernels = {f"{p.program}: {k.name} grid {k.grid}": k for p in build.programs for k in p.kernels}
    bad = [
        f"{where}: {k.stack_bytes} B stack, {k.spill_store_bytes}/{k.spill_load_bytes} B spill stores/loads, "
        f"{k.registers} registers, {k.tensor_core_mma} tensor-core MMA, {k.sass['FFMA']} FFMA"
        for where, k in kernels.items()
        if k.stack_bytes or not k.tensor_core_mma
    ]
    assert not bad, "\n".join(bad)


# The TPU v5e and the H200, the latter with the kernel report's tools.
BOTH_CHIPS_WITH_KERNEL_TOOLS = [
    pytest.param(TPU, marks=needs_tpu, id="tpu-v5e"),
    pytest.param(GPU, marks=[needs_gpu, needs_kernel_tools], id="gpu-h200"),
]


@pytest.mark.parametrize("target", BOTH_CHIPS_WITH_KERNEL_TOOLS)
def test_lora_programs_compile_for_the_chips_and_leave_the_gpu_kernels_as_they_are(target):
    # The adapters' slots among the parameters, each token's slot in the steps, and the slot fill program. Their
    # products are XLA's dots around the attention, outside the Pallas kernels: on the GPU the forward passes launch the
    # same kernels, none with a stack frame and each multiplying on the tensor cores (the default model's shape, 2
    # layers, as test_the_gpu_kernels_spill_nothing_and_multiply_on_the_tensor_cores: the tiny model's head_dim of 16
    # makes kernels of their own). On the GPU the kernel report reads the same compiles: one build serves both checks.
    model = dataclasses.replace(aot.model_shape("default"), num_layers=2)
    build = aot.build(target, EngineConfig(**LORA_ENGINE), model)
    build.runners[0].compiler_options = XLA_OPTIMIZATION if target is GPU else None
    aot.compile_all(build, kinds={"pool", "forward", "lora"})
    assert [p.kind for p in build.programs] == ["pool", "forward", "forward", "lora"]  # decode, mixed T = 16; the fill
    _checked(build)
    slots = build.runners[0].params["lora"]  # shapes on the target's (compile-only) device, as the runner keeps them
    assert {frozenset(x.sharding.device_set) for x in jax.tree.leaves(slots)} == {frozenset(target.devices(1))}
    assert build.lora_bytes == aot.placed_bytes(slots) > 0
    fill = build.programs[-1]
    assert fill.alias_bytes >= build.lora_bytes and not fill.collectives  # the slots written in place (donated)
    if target is not GPU:
        return
    forward = [p for p in build.programs if p.kind == "forward"]
    assert [[(k.name, k.count) for k in p.kernels] for p in forward] == [
        [("jaxpage_gpu_decode_attention", model.num_layers)],
        [("jaxpage_gpu_ragged_attention", model.num_layers)],
    ]
    bad = [
        f"{p.program}: {k.name}: {k.stack_bytes} B stack, {k.spill_store_bytes}/{k.spill_load_bytes} B spill "
        f"stores/loads, {k.registers} registers, {k.tensor_core_mma} tensor-core MMA"
        for p in forward
        for k in p.kernels
        if k.stack_bytes or not k.tensor_core_mma
    ]
    assert not bad, "\n".join(bad)


# The scopes of the forward pass that the batch-invariant mode runs ROW_TILE rows at a time (each layer's projections
# and norms, and the final norm), and of the sampler (the tied LM head, then the sampling of each tile of rows).
ROW_TILED_FORWARD = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_norm",
                     "post_attention_norm", "norm"}  # fmt: skip
ROW_TILED_SAMPLER = {"Llama.logits", "jit(_sample_fn)"}


def row_tiled_scopes(hlo: str) -> set[str]:
    """The scopes (jax's name stack in the HLO's op_name metadata) directly around the row tiles' loops that the
    compiled program kept: each `while` with KEEP_ONE_TRIP_LOOP's attribute, one trip (one tile holds every row of a
    small step) or several. Their bodies' metadata is not read: XLA shares one body among loops of the same ops (the
    norms, and projections of one shape), under the first one's names."""
    scopes = set()
    for line in hlo.splitlines():
        if re.search(r"\swhile\(", line) and all(f'{k}="{v}"' in line for k, v in KEEP_ONE_TRIP_LOOP.items()):
            scopes.add(re.search(r'op_name="([^"]*)"', line).group(1).split("/")[-2])
    return scopes


@pytest.mark.parametrize("target", BOTH_CHIPS_WITH_KERNEL_TOOLS)
def test_batch_invariant_programs_compile_for_the_chips_with_row_tiles_and_no_pallas_kernel(target):
    # The mode (jaxpage.models.batch_invariant) on both chips: the model's config as the engine runs it (aot.build sets
    # batch_invariant on it, as LLMEngine's as_run does), the XLA attention in its fixed order (no Pallas kernel in
    # the GPU's forward passes: the kernel report finds none), and every projection, norm and the sampler in row tiles.
    # The default model's shape (its LM head tied: invariant_matmul), one layer: the layers' programs are alike.
    model = dataclasses.replace(aot.model_shape("default"), num_layers=1)
    build = aot.build(target, EngineConfig(**BATCH_INVARIANT_ENGINE), model)
    aot.compile_all(build, kinds={"pool", "forward", "sample"})
    assert [p.kind for p in build.programs] == ["pool", "forward", "sample", "forward"]  # decode, sampler, mixed T=16
    failed = {p.program: p.error for p in build.programs if not p.compiled}
    assert not failed, failed
    assert build.backend.name == "xla" and build.backend.batch_invariant
    runner = build.runners[0]
    assert runner.config.batch_invariant and build.model.tie_word_embeddings
    for shape, program in runner.executables.items():
        assert row_tiled_scopes(program.as_text()) >= ROW_TILED_FORWARD, (shape, row_tiled_scopes(program.as_text()))
    [sampler] = runner.samplers.values()
    assert row_tiled_scopes(sampler.as_text()) >= ROW_TILED_SAMPLER, row_tiled_scopes(sampler.as_text())
    if target is GPU:
        assert [p.kernels for p in build.programs if p.kind == "forward"] == [(), ()]
    _checked(build)


@needs_tpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_host_tier_s_copies_compile_for_a_tpu_and_move_only_their_pages(kv_cache_dtype):
    # Issue 46: the offload and load programs (jaxpage.worker.host_kv_pool) between the pool, in the TPU layout (kv
    # heads in rows, 8-bit scales in blocks), and host slots in pinned host memory. Neither copies the pool or the host
    # slots whole: each moves its 8 pages (temporaries of a few pages; the scale blocks pad them). Not for the H200:
    # the deviceless GPU client's devices have no memories (no host memory kind to build for).
    model = dataclasses.replace(aot.model_shape("default"), num_layers=2)
    build = aot.build(TPU, EngineConfig(kv_cache_dtype=kv_cache_dtype, **TINY_ENGINE), model)
    pool = build.runners[0].pool
    slots = 64
    pool.add_host_tier((slots,))
    page_bytes = pool.host.page_bytes[0]
    for kind in ("offload", "load"):
        compiled = pool.host.program(kind, 0, pool.shapes())
        memory = compiled.memory_analysis()
        assert memory.temp_size_in_bytes <= 4 * TRANSFER_CHUNK * page_bytes, (kind, memory.temp_size_in_bytes)
        assert not large_copies(compiled.as_text(), min(build.pool_array_bytes, page_bytes * slots // 2)), kind
    assert all(s.memory_kind == "pinned_host" for s in jax.tree.leaves(pool.host.shardings(0)))


@needs_gpu
def test_a_gpu_built_for_without_one_refuses_the_host_tier_by_name():
    # The deviceless GPU client's devices list no memories (no pinned host memory to place the host slots in): the
    # host tier's copies build for a GPU only on one (scripts/device_checks.sh runs them there).
    model = dataclasses.replace(aot.model_shape("default"), num_layers=2)
    with pytest.raises(ValueError, match="kv_offload_bytes: the gpu devices here offer no pinned host memory"):
        aot.build(GPU, EngineConfig(kv_offload_bytes=1 << 30, **TINY_ENGINE), model)


@needs_tpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_xla_attention_reads_a_tpu_pool_in_place(kv_cache_dtype):
    # attention_impl="xla" built for a TPU keeps the pool in the TPU layout (jaxpage.attention.xla.XlaTpuAttention): in
    # its own layout the default model's pool (3 kv heads x 64) was laid out pages-minor and copied whole, in and out,
    # by every forward pass (and at the engine's sizes asked 41.6 GB of temporaries of a v5e). One layer, the decode
    # and mixed programs (the prefill loop included), 8-bit pages with their scale blocks too.
    model = dataclasses.replace(aot.model_shape("default"), num_layers=1)
    engine = EngineConfig(attention_impl="xla", kv_cache_dtype=kv_cache_dtype, **TINY_ENGINE | dict(max_num_seqs=1))
    build = aot.build(TPU, engine, model)
    aot.compile_all(build, kinds={"pool", "forward"})
    assert build.backend.name == "xla" and build.backend.tpu_layout
    assert build.model.num_kv_heads * build.model.head_dim % 128  # a pool whose own layout would be padded
    _checked(build)


@needs_gpu
def test_batch_invariant_builds_refuse_a_mixture_of_experts_as_the_engine_does(tiny_model_path):
    moe = next(f for f in FAMILIES_TO_COMPILE if f.name == "qwen3-moe-norm-topk")
    with pytest.raises(ValueError, match="engine argument batch_invariant: a mixture of experts multiplies"):
        aot.build(GPU, EngineConfig(**BATCH_INVARIANT_ENGINE), aot.model_shape(str(tiny_model_path(moe))))


def test_a_dump_directory_joins_a_runners_compiler_options_while_it_compiles():
    runner = types.SimpleNamespace(compiler_options=XLA_OPTIMIZATION)
    with aot.dumped(runner, True) as directory:
        assert runner.compiler_options == XLA_OPTIMIZATION | {"xla_dump_to": directory} and Path(directory).is_dir()
    assert runner.compiler_options == XLA_OPTIMIZATION and not Path(directory).exists()
    with aot.dumped(runner, False) as directory:
        assert directory is None and runner.compiler_options == XLA_OPTIMIZATION


def test_compile_for_refuses_bad_arguments_in_one_line(capsys):
    assert _compile_for_script().main(["--target", "tpu-v4", "--model", "llama3-8b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compile_for.py: error: unknown target 'tpu-v4'") and err.count("\n") == 1
    argv = ["--target", "gpu-h200", "--model", "llama3-8b", "--enable-lora", "--max-loras", "0"]
    assert _compile_for_script().main(argv) == 2  # the engine arguments' own check, before anything is built
    err = capsys.readouterr().err
    assert err.startswith("compile_for.py: error: engine argument max_loras must be") and err.count("\n") == 1
    argv = ["--target", "gpu-h200", "--model", "llama3-8b", "--batch-invariant", "--quantization", "int8"]
    assert _compile_for_script().main(argv) == 2  # the mode's own refusal: --batch-invariant reaches the engine config
    err = capsys.readouterr().err
    assert err.startswith("compile_for.py: error: engine argument batch_invariant: quantization 'int8'")
    assert err.count("\n") == 1


def test_collectives_are_counted_through_a_loop_whose_bound_is_in_its_condition():
    # The TPU compiler's scan loop has no known_trip_count: its condition compares the counter with a constant.
    hlo = """
HloModule m
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %ar.2 = f32[8]{0} all-reduce(%ar), replica_groups={{0,1}}, to_apply=%add
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %constant.1 = s32[]{:T(128)} constant(30)
  %gte = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%gte, %constant.1), direction=LT
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %e = f32[8]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
  ROOT %g = f32[8,2]{1,0} all-gather(%y), dimensions={1}
}"""
    assert {k: n for k, n in executed(hlo).items() if n} == {"all-reduce": 2 * 30 + 1, "all-gather": 1}


def test_an_8bit_pool_the_gpu_kernels_cannot_address_is_cut_or_refused():
    model = aot.LLAMA3_8B  # 32 layers x 16 tokens x 8 KV heads x 128 dims = 512 KiB per page of an 8-bit K array
    page = 32 * 16 * 8 * 128
    gpu = resolve_backend("pallas_gpu", "int8", platform="gpu")
    assert gpu.addressable_pages(model, 3 * 2**30 // page, 16) == 2**31 // page  # 3 GiB: cut to 2 GiB
    assert gpu.addressable_pages(model, 5 * 2**30 // page, 16) == 5 * 2**30 // page  # over 4 GiB: 64-bit offsets
    assert gpu.addressable_pages(model, 3 * 2**30 // page, 16, tensor_parallel_size=2) == 3 * 2**30 // page
    for backend in (
        resolve_backend("pallas_gpu", "auto", platform="gpu"),
        resolve_backend("xla", "int8"),
    ):
        assert backend.addressable_pages(model, 3 * 2**30 // page, 16) == 3 * 2**30 // page
    explicit = EngineConfig(num_pages=3 * 2**30 // page, kv_cache_dtype="int8", compilation_cache_dir=None)
    with pytest.raises(ValueError, match=r"num_pages 6144: the pallas_gpu kernels cannot address an int8 pool"):
        addressable_pages(gpu, model, explicit.num_pages, explicit.part(CacheConfig), 1)
    assert addressable_pages(gpu, model, 6144, EngineConfig(compilation_cache_dir=None).part(CacheConfig), 1) == 4096


@pytest.mark.parametrize("target", [pytest.param(TPU, marks=needs_tpu), pytest.param(GPU, marks=needs_gpu)],
                         ids=["tpu-v5e", "gpu-h200"])  # fmt: skip
def test_pooling_models_step_programs_compile_for_the_chips(target, tiny_model_path):
    """An encoder's (BERT) and a decoder embedder's steps, one program per token bucket, reading each layer's weights in
    place (the GPU's layers unrolled as the decoders' are)."""
    from jaxpage.models.bert import EncoderConfig

    encoder = EncoderConfig("bert", 512, 64, 2, 4, 128, 128, 2, 1e-12, "gelu", 0, "bert", 1, ("LABEL_0",))
    decoder = aot.model_shape(str(tiny_model_path(TINY_GQA)))
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, compilation_cache_dir=None)
    for config in (encoder, decoder):
        reports, weight_bytes = aot.compile_pooling(target, config, engine)
        shapes = [(16, 16), (16, 32), (32, 32)]  # (row length, tokens)
        assert [r.program for r in reports] == [
            f"pooling T={t}, L={n}, S={min(t, max(4, 4 * t // n))}" for n, t in shapes
        ]
        assert all(r.compiled and not r.weight_copies for r in reports), [(r.program, r.error) for r in reports]
        assert weight_bytes > 0


QUANTIZED_SCHEMES = {  # jaxpage.config.weight_quantization: what the checkpoints' readers give
    "w4a16-groups": dict(method="compressed-tensors", weight_dtype="int4", block=(128, 1)),
    "awq-zero-points": dict(method="awq", weight_dtype="int4", block=(128, 1), symmetric=False),
    "fp8-blocks": dict(method="fp8", weight_dtype="float8_e4m3fn", block=(128, 128)),
    "fp8-channel": dict(method="compressed-tensors", weight_dtype="float8_e4m3fn", block=(0, 1)),
    "w8a16-groups-zero-points": dict(method="compressed-tensors", weight_dtype="int8", block=(128, 1), symmetric=False),
    "w8a8-int8": dict(method="compressed-tensors", weight_dtype="int8", block=(0, 1), activations="int8"),
}


QUANTIZED_SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_layers=2, num_heads=8, num_kv_heads=4,
                       head_dim=128, vocab_size=4096)  # fmt: skip
SMALLEST_WEIGHT = 1024 * 512 * 2  # k_proj's, in bfloat16


def _quantized_forward_temporaries(target, scheme, kernels: bool = False) -> tuple[list[int], list]:
    """Each forward step's temporaries of QUANTIZED_SHAPE under `scheme` on `target`, and the reports."""
    from jaxpage.config.weight_quantization import WeightQuantization

    shape = dataclasses.replace(aot.model_shape("default"), **QUANTIZED_SHAPE)
    engine = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_pages=64, page_size=16,
                          compilation_cache_dir=None)  # fmt: skip
    model = dataclasses.replace(shape, weight_quantization=scheme and WeightQuantization(**scheme))
    build = aot.build(target, engine, model)
    if kernels:
        build.runners[0].compiler_options = XLA_OPTIMIZATION
    reports = aot.compile_all(build, kinds={"forward"}, kernels=kernels)
    assert all(r.compiled for r in reports), [r.error for r in reports]
    if scheme is not None and scheme["weight_dtype"] == "int4":  # packed: half a byte a code
        codes = build.runners[0].params["layers"]["mlp"]["up_proj"]["qweight"]
        assert codes.dtype == jax.numpy.int4 and aot.placed_bytes(codes) == codes.size // 2  # as the chip holds them
    return [r.temp_bytes for r in reports], reports


@needs_tpu
def test_quantized_checkpoints_forward_steps_hold_no_dequantized_weight_on_a_tpu():
    """A model of 1024 x 4096 MLPs and 1024 x 512 K/V projections in groups of 128 (int4 codes packed by XLA, FP8):
    each forward step's temporaries exceed the float model's by less than the smallest projection's weight in
    bfloat16 (1 MiB): XLA:TPU converts the codes inside the grouped products, it never writes a dequantized weight."""
    floats, _ = _quantized_forward_temporaries(TPU, None)
    for name, scheme in QUANTIZED_SCHEMES.items():
        extra = [q - f for q, f in zip(_quantized_forward_temporaries(TPU, scheme)[0], floats, strict=True)]
        assert max(extra) < SMALLEST_WEIGHT, (name, extra)


@needs_gpu
@needs_kernel_tools
@pytest.mark.parametrize("name", list(QUANTIZED_SCHEMES))
def test_quantized_checkpoints_forward_steps_multiply_in_the_gpu_kernel_and_hold_no_dequantized_weight(name):
    """The same model on an H200: each of the 7 weight-only projections a layer (int4, int8, FP8 codes) multiplied by
    pallas_kernels.gpu_quantized_matmul in every forward step (decode and prefill alike), which spills nothing and
    multiplies on the tensor cores, reading each layer's codes from the stacked parameter where they lie; W8A8 int8 by
    XLA's integer products. No step's temporaries exceed the float model's by a projection's dequantized weight, and
    a weight-only step's hold no copy of a layer's MLP codes (XLA:GPU copied each layer's slice for a kernel given
    one: 2 MiB here, 28 MiB for an 8B model's int4 MLP weight)."""
    floats, _ = _quantized_forward_temporaries(GPU, None)
    scheme = QUANTIZED_SCHEMES[name]
    temporaries, reports = _quantized_forward_temporaries(GPU, scheme, kernels=True)
    extra = [q - f for q, f in zip(temporaries, floats, strict=True)]
    assert max(extra) < SMALLEST_WEIGHT, extra
    weight_only = scheme.get("activations") is None
    int4_mlp_codes = QUANTIZED_SHAPE["hidden_size"] * QUANTIZED_SHAPE["intermediate_size"] // 2
    assert not weight_only or max(temporaries) < int4_mlp_codes, temporaries
    launches = 7 * QUANTIZED_SHAPE["num_layers"] if weight_only else 0
    for report in reports:
        kernels = [k for k in report.kernels if k.name.startswith("jaxpage_gpu_quantized_matmul")]
        assert sum(k.count for k in kernels) == launches, (report.program, kernels)
        bad = [k for k in kernels if k.stack_bytes or k.spill_store_bytes or not k.tensor_core_mma]
        assert not bad, (report.program, bad)
